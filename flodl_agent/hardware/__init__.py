"""A box's GPUs and torch variants: discovery (vendor tools, bounded runs), the offer's
gate, which variant runs, and the variant venvs."""
