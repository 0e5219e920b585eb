// Every collective, for callers that use several.
#pragma once

#include "weightlift/comm/collectives/all_to_all.h"
#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/collectives/gather.h"
#include "weightlift/comm/collectives/reduce.h"
#include "weightlift/comm/collectives/reduce_scatter.h"
#include "weightlift/comm/group/group.h"
