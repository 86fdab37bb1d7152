"""The names of the device mesh's axes, shared by every layer that places arrays.

Members are split over MEMBER and each member's batch over DATA
(dist_ens.parallel.layout says where every leaf of the state lives on them). MODEL
splits each member's own leaves, for members larger than one device
(dist_ens.parallel.sharding_rules).
"""

MEMBER, DATA, MODEL = 'member', 'data', 'model'
