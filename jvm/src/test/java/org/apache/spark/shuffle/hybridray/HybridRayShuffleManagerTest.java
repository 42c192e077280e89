package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.Set;
import org.junit.jupiter.api.Test;

/** Which shuffles fall back to Spark's own. */
class HybridRayShuffleManagerTest {
  @Test
  void ordinaryShufflesGoThroughHybridRay() {
    assertNull(HybridRayShuffleManager.fallbackReason(false, key -> false));
  }

  @Test
  void barrierPushAndTheOldFetchProtocolFallBack() {
    assertTrue(HybridRayShuffleManager.fallbackReason(true, key -> false).contains("barrier"));
    assertTrue(HybridRayShuffleManager.fallbackReason(false,
        Set.of("spark.shuffle.push.enabled")::contains).contains("push"));
    // Every attempt of a map would share one map id, which tells attempts apart.
    assertTrue(HybridRayShuffleManager.fallbackReason(false,
        Set.of("spark.shuffle.useOldFetchProtocol")::contains).contains("useOldFetchProtocol"));
    // Memory-tier segments die with their executor; the service would not serve them.
    assertTrue(HybridRayShuffleManager.fallbackReason(false,
        Set.of("spark.shuffle.service.enabled")::contains).contains("external shuffle service"));
  }
}
