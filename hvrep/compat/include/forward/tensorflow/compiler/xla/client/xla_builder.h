#include "xla/hlo/builder/xla_builder.h"
