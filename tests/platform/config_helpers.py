"""The smallest valid experiment config as a raw dict (the config tests' starting point)."""


def base() -> dict:
    return {
        "name": "t",
        "model": {"name": "gmmformer", "hidden_size": 32},
        "losses": {
            "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip", "margin": 0.1},
            "clip_nce": {"loss": "infonce", "weight": 0.02, "branch": "clip"},
        },
        "train": {"epochs": 2},
    }
