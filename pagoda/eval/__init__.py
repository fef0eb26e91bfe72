"""Model-quality evaluation: `pagoda eval perplexity`."""
