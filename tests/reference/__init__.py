"""Reference models: plain-Python oracles that the native cache core is tested against."""
