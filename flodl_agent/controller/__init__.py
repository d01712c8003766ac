"""The controller: the join window, admission and the formed world's supervision (pure
cores), and the one port that serves them: accept, listener, links, traffic, HTTP."""
