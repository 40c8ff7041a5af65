"""Models: loading and saving directories (loading), prompt text and ids (prompts), the
training forward (forward), generation with sampling log-probs (generate, sampler), and the
embedded tiny model (tiny)."""
