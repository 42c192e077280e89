package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.ray.api.exception.RayTimeoutException;
import java.io.IOException;
import org.junit.jupiter.api.Test;

class RaySegmentSinkTest {
  @Test
  void aCommitThatTimedOutIsToldApartFromOneTheMasterRefused() {
    // A timed-out commit may still be applied by the master (its abort then frees the
    // batch): the sink must not give the batch's grants back as well.
    assertTrue(RaySegmentSink.timedOut(new IOException("hybrid_ray call spark_commit failed",
        new RayTimeoutException("Get timed out: some object(s) not ready."))));
    assertFalse(RaySegmentSink.timedOut(new IOException("hybrid_ray call spark_commit failed",
        new RuntimeException("ShuffleStateError: attempt 3 of map 0 was aborted"))));
    assertFalse(RaySegmentSink.timedOut(new IOException("no cause")));
  }
}
