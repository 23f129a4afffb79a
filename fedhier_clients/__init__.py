"""Flower ClientApp side of fedhier (``fedhier_clients.app:app``)."""
