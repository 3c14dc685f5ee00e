// MergerFaults::from_environment: the fault-injection switches of the tests are read strictly, so
// a typo cannot silently turn a fault off (or on).
#include <catch2/catch.hpp>

#include <cstdlib>

#include "core/errors.h"
#include "merger/merger_process.h"

using namespace diloco;
using Catch::Matchers::Contains;

TEST_CASE("DILOCO_FAULT_* values: unset or empty is off, a count is read, anything else is refused", "[merger][faults]") {
  ::unsetenv("DILOCO_FAULT_FAIL_COMMIT");
  ::unsetenv("DILOCO_FAULT_FAIL_RECOVERY");
  CHECK(MergerFaults::from_environment().fail_commit == 0);
  CHECK(MergerFaults::from_environment().fail_recovery == 0);
  ::setenv("DILOCO_FAULT_FAIL_COMMIT", "", 1);
  CHECK(MergerFaults::from_environment().fail_commit == 0);
  ::setenv("DILOCO_FAULT_FAIL_COMMIT", "3", 1);
  ::setenv("DILOCO_FAULT_FAIL_RECOVERY", "2", 1);
  CHECK(MergerFaults::from_environment().fail_commit == 3);
  CHECK(MergerFaults::from_environment().fail_recovery == 2);
  for (const char* bad : {"x", "12abc", "-1", "1.5", " 2"}) {
    INFO(bad);
    ::setenv("DILOCO_FAULT_FAIL_COMMIT", bad, 1);
    CHECK_THROWS_WITH(MergerFaults::from_environment(), Contains("DILOCO_FAULT_FAIL_COMMIT must be a count"));
  }
  ::setenv("DILOCO_FAULT_FAIL_COMMIT", "1", 1);
  ::setenv("DILOCO_FAULT_FAIL_RECOVERY", "once", 1);
  CHECK_THROWS_WITH(MergerFaults::from_environment(), Contains("DILOCO_FAULT_FAIL_RECOVERY"));
  ::unsetenv("DILOCO_FAULT_FAIL_COMMIT");
  ::unsetenv("DILOCO_FAULT_FAIL_RECOVERY");
}
