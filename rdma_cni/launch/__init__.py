"""The packed binary's start-up: the warm server, cold-start economies, the launcher's trailer, its cache.

``warm`` (the forking server ``launcher/warm.c`` hands verbs to), ``startup``
(modules a verb imports but never uses, deferred), ``payload`` (which build a
launcher file carries), ``cacheprune`` (other versions' unpacked trees
removed). Kept empty: a CNI verb imports this package on every cold start.
"""
