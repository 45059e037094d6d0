"""``vlmcache bench``: replay image conversations against any OpenAI-compatible server.

``client`` streams one chat completion and times it, ``replay`` turns a conversation fixture
into requests (with or without cache reuse possible), ``ceiling`` computes the reusable-token
ceiling with the fixture model's own prompt builder, ``report`` prints and saves the results,
``plot`` draws TTFT per turn, ``command`` wires them to the CLI.
"""
