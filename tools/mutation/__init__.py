"""Mutation testing of the numerical core with mutmut (`make mutants`); see report.py."""
