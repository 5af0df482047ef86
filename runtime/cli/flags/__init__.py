"""The flag families of ``flare run`` (families.py), one module each."""
