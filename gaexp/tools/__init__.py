"""gaexp's tools: the commands that measure, generate and serve around the application, which nothing in the
application imports (tests/test_config.py checks it). Each is `python -m gaexp.tools.NAME`; the names they were
first announced by (`python -m gaexp.NAME`) run them too.

- `bench`: every norm eager beside compiled, against no norm, and the grid's estimate;
- `drift`: each precision's accumulated gradient against float64 for k = 1 to 256, with training speed and memory;
- `zoo`: gaexp-check on every torchvision classification model against the truth worked out without it;
- `gpucheck`: the GPU check (speeds, a deterministic rerun, a grid against the CPU, cells sharing the device);
- `eta_replay`: a finished sweep's ETA at each cell's end, replayed from its runs, beside the truth;
- `storegen`: a store of N gaexp-shaped runs in seconds; `storebench`: the store's reads on growing stores;
- `server`: `make server`, MLflow's server on a SQLite store, locked beyond the loopback;
- `ui`: `make ui`, the store's experiments tagged and linked, then `mlflow ui`.
"""
