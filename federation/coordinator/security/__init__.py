"""Certificates after the first: renewal (``renewal.Renewal``) and their expiries
(``expiry.Expiries``), for the federation status and the metrics."""
