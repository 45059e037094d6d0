"""``vlmcache cache stats|verify|gc|erase``: tools for a cache directory of a stopped server."""
