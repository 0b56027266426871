"""Shared code of the results files, the README table and the plots."""
