"""Flower ClientApp side of fedhier (``fedhier.clients.app:app``)."""
