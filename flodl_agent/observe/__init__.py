"""What an operator sees: progress reports and /metrics, the page's history, the status
page, ``fdl status`` and the last launch's verdict."""
