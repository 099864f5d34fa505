"""Models: the models.toml registry (registry.py) and Hugging Face downloads (hub.py).
The registry depends on the hub; the hub knows only hub references and sha256 pins."""
