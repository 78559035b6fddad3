"""Retrieval evaluation: metrics and rank tables (``metrics``), encoding and ranking a split (``retrieval``).

Both the training platform and the reports import from here; it imports nothing from either.
"""
