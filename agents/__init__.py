"""stable-baselines3 setups for budget policies: algorithms, hyperparameters, callbacks."""
