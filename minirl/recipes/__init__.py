"""Recipes: what a run is made of, apart from the library's core. Tasks and their rewards (tasks,
rewards), multi-turn environments (envs), group filters (filters), the tiny local model (tiny), the
packaged SmolLM2 (packaged) and run tracking (tracking). launch/, benchmarks/ and tests import them;
the core (minirl/*.py) and actors/ never do."""
