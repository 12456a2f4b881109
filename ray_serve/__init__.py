"""modserve on Ray Serve: the same pipeline and OpenAI routes, one engine per Ray replica.

An ingress deployment takes HTTP from Ray Serve's proxy and forwards each request whole to an
engine replica, chosen by a prefix-aware request router; each engine replica runs the
pipeline's engine behind the very app ``modserve serve`` runs. Installed with
``pip install modserve[ray]``; nothing else in modserve imports this package.
"""
