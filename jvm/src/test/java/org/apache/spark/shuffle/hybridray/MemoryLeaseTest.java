package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import org.junit.jupiter.api.Test;

class MemoryLeaseTest {
  @Test
  void batchesThatFitAreTakenWholeAndTheRestGoesBackOnce() {
    MemoryLease lease = new MemoryLease(100, "plasma");
    assertTrue(lease.take(new int[] {30, 20}));
    assertFalse(lease.take(new int[] {40, 20}));  // 60 > 50 left: none of it is taken
    assertEquals(50, lease.remaining());
    assertTrue(lease.take(new int[] {50}));
    assertEquals(0, lease.remaining());
    assertNull(lease.leftover());  // all used: nothing to give back
  }

  @Test
  void theLeftoverIsAnUnusedMemoryGrantOfTheRest() {
    MemoryLease lease = new MemoryLease(100, "plasma");
    assertTrue(lease.take(new int[] {30}));
    RaySegmentSink.Settlement rest = lease.leftover();
    assertEquals(new RaySegmentSink.Settlement("memory", 70, "plasma", -1, ""), rest);
    assertNull(lease.leftover());  // given back once
    assertFalse(lease.take(new int[] {1}));  // a closed lease places nothing
    assertEquals(0, lease.remaining());
    // The leftover names the books that granted the lease.
    MemoryLease named = new MemoryLease(100, "plasma", "books-1");
    assertEquals(new RaySegmentSink.Settlement("memory", 100, "plasma", -1, "books-1"),
        named.leftover());
  }

  @Test
  void badSizesAreRefused() {
    assertThrows(IllegalArgumentException.class, () -> new MemoryLease(0, "plasma"));
    MemoryLease lease = new MemoryLease(10, "plasma");
    assertThrows(IllegalArgumentException.class, () -> lease.take(new int[] {-1}));
  }

  @Test
  void leaseSizeFollowsTheLastTaskOfTheShuffleUpToTheCap() {
    assertEquals(4 << 20, HybridRayContext.leaseSize(4 << 20, 32 << 20, null));
    assertEquals(1250, HybridRayContext.leaseSize(4 << 20, 32 << 20, 1000L));
    assertEquals(32 << 20, HybridRayContext.leaseSize(4 << 20, 32 << 20, 100L << 20));
    assertEquals(0, HybridRayContext.leaseSize(4 << 20, 32 << 20, 0L));
    assertEquals(0, HybridRayContext.leaseSize(0, 32 << 20, 1000L));  // leases off
  }
}
