"""Analyses across finished runs (no model is loaded): the papers' scaling comparisons."""
