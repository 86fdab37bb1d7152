"""The names of the device mesh's axes, shared by every layer that places arrays.

Members are split over MEMBER and each member's batch over DATA
(dist_ens.parallel.layout says where every leaf of the state lives on them).
"""

MEMBER, DATA = 'member', 'data'
