package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import org.junit.jupiter.api.Test;

/**
 * The manager's size and time settings are checked when its context is made, each error
 * naming the setting: a segment size of "4g" was cast to int as 0 ("2g": negative) and
 * failed later, naming no setting. (Spark's own parsing of "4g" is not exercised here:
 * SparkConf needs Spark's shaded libraries, which are not on the test classpath.)
 */
class HybridRayContextSettingsTest {
  private static final String SEGMENT = HybridRayContext.CONF_SEGMENT_BYTES;

  @Test
  void aSegmentSizeBeyondOneGibOrBelowOneByteIsRefusedNamingTheSetting() {
    long[] values = {4L << 30, 2L << 30, 0, -1};
    String[] raws = {"4g", "2g", "0", "-1"};
    for (int i = 0; i < values.length; i++) {
      long value = values[i];
      String raw = raws[i];
      IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
          () -> HybridRayContext.inRange(SEGMENT, raw, value, "bytes", "4m", 1,
              HybridRayContext.MAX_SEGMENT_BYTES));
      assertEquals("hybrid_ray: " + SEGMENT + "=" + raw + " is " + value + " bytes; it must "
          + "be between 1 and 1073741824 bytes (default 4m)", e.getMessage());
    }
  }

  @Test
  void aSettingInItsRangeIsTakenAsGiven() {
    assertEquals(8L << 20, HybridRayContext.inRange(SEGMENT, "8m", 8L << 20, "bytes", "4m",
        1, HybridRayContext.MAX_SEGMENT_BYTES));
    assertEquals(1L << 30, HybridRayContext.inRange(SEGMENT, "1g", 1L << 30, "bytes", "4m",
        1, HybridRayContext.MAX_SEGMENT_BYTES));
    assertEquals(0L, HybridRayContext.inRange(HybridRayContext.CONF_COMMIT_WAIT_MS, "0s", 0,
        "ms", "30s", 0, Long.MAX_VALUE));
  }

  @Test
  void aTimeoutOfZeroIsRefusedNamingTheSetting() {
    String key = HybridRayContext.CONF_FETCH_TIMEOUT_MS;
    IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
        () -> HybridRayContext.inRange(key, "0s", 0, "ms", "10min", 1, Long.MAX_VALUE));
    assertEquals("hybrid_ray: " + key + "=0s is 0 ms; it must be between 1 and "
        + Long.MAX_VALUE + " ms (default 10min)", e.getMessage());
  }
}
