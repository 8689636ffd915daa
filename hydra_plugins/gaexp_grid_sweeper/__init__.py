"""gaexp's grid sweeper: Hydra's basic sweeper, longest cells first, with progress: `hydra/sweeper=gaexp_grid`."""
