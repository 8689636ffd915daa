"""gaexp: does gradient accumulation stand in for a big batch, and which norms break it?"""

from gaexp.config import register_resolvers

register_resolvers()
