"""Write each role's README.md from its meta/argument_specs.yml.

python scripts/role_readme.py           # rewrite every roles/*/README.md
python scripts/role_readme.py --check   # exit 1 when one is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROLES = Path(__file__).resolve().parents[1] / "roles"
PIPE = "\\|"  # a literal pipe inside a Markdown table cell
NOTE = "<!-- Generated from meta/argument_specs.yml by scripts/role_readme.py: edit the spec, not this. -->"

EXAMPLES = {
    "flodl_controller": """- name: Controller
  hosts: flodl_controllers
  roles:
    - role: flodl_controller
      vars:
        flodl_controller_join: {start: hybrid, min_rank_start: 2}
        flodl_controller_door_keys:
          - "ssh-ed25519 AAAA... flodl-join@gpu-a\"""",
    "flodl_worker": """- name: Workers
  hosts: flodl_workers
  roles:
    - role: flodl_worker
      vars:
        flodl_worker_controller: ctrl.example.com
        flodl_worker_door_host_key: "ssh-ed25519 AAAA..."
        flodl_worker_libtorch: cu128
        flodl_worker_local_devices: [0, 1]""",
}


def _plain(text: str) -> str:
    # ansible-doc markup -> Markdown
    return re.sub(r"C\(([^)]*)\)", r"`\1`", text)


def _text(value: Any) -> str:
    return _plain(" ".join(value) if isinstance(value, list) else str(value))


def render(role: Path) -> str:
    spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]
    lines = [
        f"# {role.name}",
        "",
        f"{_text(spec['short_description'])}.",
        "",
        _text(spec.get("description", "")),
        "",
        NOTE,
        "",
        "## Variables",
        "",
        "| variable | type | default | description |",
        "|---|---|---|---|",
    ]
    for name, option in spec["options"].items():
        kind = option.get("type", "str")
        if option.get("elements"):
            kind += f" of {option['elements']}"
        if option.get("choices"):
            kind += " (" + ", ".join(map(str, option["choices"])) + ")"
        default = "**required**" if option.get("required") else f"`{option.get('default', '')}`"
        cells = [f"`{name}`", kind, default, _text(option.get("description", ""))]
        lines.append("| " + " | ".join(cell.replace("|", PIPE) for cell in cells) + " |")
    lines += ["", "## Example", "", "```yaml", EXAMPLES.get(role.name, ""), "```", ""]
    return "\n".join(lines)


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for role in sorted(p for p in ROLES.iterdir() if (p / "meta" / "argument_specs.yml").exists()):
        text = render(role)
        readme = role / "README.md"
        if check:
            if not readme.exists() or readme.read_text() != text:
                stale.append(str(readme))
        else:
            readme.write_text(text)
    for path in stale:
        print(f"{path} does not match its argument spec: run python scripts/role_readme.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
