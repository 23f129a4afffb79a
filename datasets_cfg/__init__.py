"""Dataset descriptions shipped with fedhier (one TOML per dataset)."""
