"""What a capture lets in: the GPU stack's variables, credential-like names redacted, and the
README's lines per file (the capture itself runs for real in tests/integration/test_capture.py)."""

from __future__ import annotations

from flodl_agent.hardware.capture_files import Entry, credential_like, gpu_env, readme, redact_words, tool_env

TOKEN = "0123456789abcdef" * 2


def test_only_the_gpu_stacks_variables_enter_and_credential_like_ones_are_only_named() -> None:
    env = {
        "FDL_TOKEN": TOKEN,
        "FLODL_LIBTORCH_ROOT": "/opt/flodl/libtorch",
        "HSA_OVERRIDE_GFX_VERSION": "11.0.0",
        "HIP_VISIBLE_DEVICES": "0,1",
        "ROCR_VISIBLE_DEVICES": "GPU-1234",
        "LD_LIBRARY_PATH": "/opt/rocm/lib",
        "NCCL_PROXY_URL": "http://op:hunter2@proxy.lan:3128",
        "AWS_SECRET_ACCESS_KEY": "x" * 40,
        "HOME": "/home/op",
    }
    assert gpu_env(env).splitlines() == [
        "FDL_TOKEN=<redacted>",
        "FLODL_LIBTORCH_ROOT=/opt/flodl/libtorch",
        "HIP_VISIBLE_DEVICES=0,1",
        "HSA_OVERRIDE_GFX_VERSION=11.0.0",
        "LD_LIBRARY_PATH=/opt/rocm/lib",
        "NCCL_PROXY_URL=http://<redacted>@proxy.lan:3128",
        "ROCR_VISIBLE_DEVICES=GPU-1234",
    ]
    assert gpu_env({"HOME": "/root"}) == "(none of the GPU stack's variables is set)\n"


def test_tools_run_without_anything_credential_like() -> None:
    env = tool_env({"FDL_TOKEN": TOKEN, "GITHUB_TOKEN": "g", "SSH_AUTH_SOCK": "/s", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "LC_ALL": "C"}
    assert [credential_like(n) for n in ("db_password", "API_KEY", "HIP_VISIBLE_DEVICES")] == [
        True,
        True,
        False,
    ]


def test_a_kernel_command_line_keeps_its_words_but_no_credential_value() -> None:
    line = "quiet amdgpu.ppfeaturemask=0xffffffff iommu=pt vault.token=s3cr3t --auth-key=abc"
    assert (
        redact_words(line)
        == "quiet amdgpu.ppfeaturemask=0xffffffff iommu=pt vault.token=<redacted> --auth-key=<redacted>"
    )


def test_the_readme_says_how_each_file_came() -> None:
    entries = [
        Entry("tools/rocminfo.txt", "rocminfo: the agents", "rocminfo", "failed", exit=1),
        Entry("tools/rocm-smi.txt", "rocm-smi", "rocm-smi", "timeout", note="cut after 10 s"),
        Entry("dmesg.txt", "the kernel's lines", "dmesg", truncated=True),
    ]
    text = readme({"host": "amd-a", "created": "2026-01-01T00:00:00Z", "fdl": "0.1.0"}, entries)
    assert text.startswith("flodl fleet capture of amd-a at 2026-01-01T00:00:00Z (fdl 0.1.0)\n")
    lines = text.splitlines()
    assert "tools/rocminfo.txt  failed, exit 1 rocminfo: the agents" in lines
    assert "tools/rocm-smi.txt  timeout        rocm-smi (cut after 10 s)" in lines
    assert "dmesg.txt           ok, truncated  the kernel's lines" in lines
    assert "                                   from: dmesg" in lines
