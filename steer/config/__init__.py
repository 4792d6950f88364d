"""The config: the typed schema Hydra merges conf/ onto, and the cross-field checks every entry point runs."""
