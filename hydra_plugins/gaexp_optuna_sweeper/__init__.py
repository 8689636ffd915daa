"""gaexp's Hydra sweeper over Optuna's ask/tell API (Optuna 5): `hydra/sweeper=gaexp_optuna`."""
