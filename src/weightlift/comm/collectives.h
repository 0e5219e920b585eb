// Every collective, for callers that use several.
#pragma once

#include "weightlift/comm/all_to_all.h"
#include "weightlift/comm/allgather.h"
#include "weightlift/comm/allreduce.h"
#include "weightlift/comm/barrier.h"
#include "weightlift/comm/broadcast.h"
#include "weightlift/comm/gather.h"
#include "weightlift/comm/group.h"
#include "weightlift/comm/reduce.h"
#include "weightlift/comm/reduce_scatter.h"
