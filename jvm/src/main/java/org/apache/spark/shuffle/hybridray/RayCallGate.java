package org.apache.spark.shuffle.hybridray;

/**
 * The driver's calls into Ray, and a bounded wait for those in flight before Ray shuts
 * down. RayDP shuts the driver JVM's Ray down before it stops Spark, and a call still
 * using Ray's core worker then crashed the JVM: {@link HybridRayShuffleManager#quiesceDriver}
 * closes the gate (no call starts after it) and waits for the calls that entered.
 */
final class RayCallGate {
  private int inFlight;
  private boolean closed;

  /** Enter a call; false (and nothing entered) once the gate is closed. */
  synchronized boolean enter() {
    if (closed) {
      return false;
    }
    inFlight++;
    return true;
  }

  /** Leave a call entered with {@link #enter}. */
  synchronized void exit() {
    inFlight--;
    notifyAll();
  }

  synchronized boolean isClosed() {
    return closed;
  }

  /**
   * Close the gate and wait, at most {@code timeoutMs}, for the calls in flight; true if
   * none is left.
   */
  synchronized boolean closeAndDrain(long timeoutMs) throws InterruptedException {
    closed = true;
    long deadline = System.nanoTime() + timeoutMs * 1_000_000L;
    while (inFlight > 0) {
      long leftMs = (deadline - System.nanoTime()) / 1_000_000L;
      if (leftMs <= 0) {
        return false;
      }
      wait(leftMs);
    }
    return true;
  }
}
