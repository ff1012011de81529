"""Environment specs: models, YAML loading with line-aware errors, cross-environment checks."""
