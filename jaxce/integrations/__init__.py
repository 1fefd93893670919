"""Integrations with training frameworks; each imports its framework, so import them by
name (``import jaxce.integrations.tunix``), never from ``jaxce`` itself."""
