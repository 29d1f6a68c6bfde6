"""Shared pytest fixtures for the isotrain suite."""
