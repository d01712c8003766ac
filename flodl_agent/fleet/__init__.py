"""Across the fleet from the controller's box: ``fdl launch`` (the window, agents started
over ssh, GPUs counted first), ``fdl publish``, ``fdl deploy`` and ``fdl @NAME probe``."""
