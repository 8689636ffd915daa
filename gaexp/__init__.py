"""gaexp: does gradient accumulation stand in for a big batch, and which norms break it?"""

from gaexp.config import register

register()  # the schema in Hydra's ConfigStore and the ${gaexp.*} resolvers, before anything composes
