"""Retrieval evaluation: metrics and rank tables (``metrics``), encoding and ranking a split (``retrieval``).

The training platform, the reports and the data summary import from here; it imports nothing from the platform or the reports.
"""
