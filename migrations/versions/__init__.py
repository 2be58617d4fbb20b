"""Revision scripts, one per schema change, named ``NNNN_what``."""
