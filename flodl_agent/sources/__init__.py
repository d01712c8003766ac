"""Where a run comes from: source specs, fetching and mirroring a tree, building it, the run manifest.

Below both the controller's ``fdl publish`` and the agent's preparation before a
dial, which share this code and nothing else.
"""
