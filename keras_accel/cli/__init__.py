"""The `keras-accel` command line: `env` (what would run here) and `bench` (the seed sweep)."""
