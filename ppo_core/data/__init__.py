"""Prompts and preference data: config, prompt loading, preference records and sources, labelers, built-in prompt sets."""
