"""Hop 1: the client API (``tierflow.v1.Tierflow``) and admission of each request."""
