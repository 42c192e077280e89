package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

class RayCallGateTest {
  @Test
  void closingWaitsForTheCallInFlightAndLetsNoneStartAfter() throws Exception {
    // quiesceDriver only stopped the heartbeat: a release still using Ray's core worker
    // when RayDP shut Ray down crashed the driver JVM.
    RayCallGate gate = new RayCallGate();
    assertTrue(gate.enter());
    CountDownLatch closed = new CountDownLatch(1);
    Thread closer = new Thread(() -> {
      try {
        if (gate.closeAndDrain(10_000)) {
          closed.countDown();
        }
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    });
    closer.start();
    assertFalse(closed.await(300, TimeUnit.MILLISECONDS), "returned with a call in flight");
    assertFalse(gate.enter(), "a call started after the gate closed");
    gate.exit();
    assertTrue(closed.await(10, TimeUnit.SECONDS));
    closer.join();
  }

  @Test
  void theWaitIsBounded() throws Exception {
    RayCallGate gate = new RayCallGate();
    assertTrue(gate.enter());
    long start = System.nanoTime();
    assertFalse(gate.closeAndDrain(200));
    assertTrue((System.nanoTime() - start) / 1_000_000 < 5_000);
  }
}
