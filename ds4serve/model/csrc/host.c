/* The host forward as one translation unit (built by model/host_forward.py; see host.h for the map).

   One unit, so the compiler sees every kernel where it is called (the products inline into the layer
   loops) and nothing but the entry points (ds4_*) is exported. */
#include "host.h"

#include "host_base.c"
#include "host_pool.c"
#include "host_kernels.c"
#include "host_stored.c"
#include "host_pairs.c"
#include "host_f8pairs.c"
#include "host_packed.c"
#include "host_q8.c"
#include "host_layers.c"
#include "host_forward.c"
