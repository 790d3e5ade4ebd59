"""How each scheme is run and checked: the registry behind `python -m parlab run SCHEME` (registry.py), the
names `python -m parlab list` shows without importing torch (catalog.py), typed options (options.py), the report
skeleton (report.py), and one module per scheme family with its rank code, its report and its run_... function."""
