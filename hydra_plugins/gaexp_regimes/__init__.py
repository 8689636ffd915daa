"""Any regime by its name, `regime=bs3a5` or `regime=w2b8a1`: a config source on gaexp's search path (source.py)."""
