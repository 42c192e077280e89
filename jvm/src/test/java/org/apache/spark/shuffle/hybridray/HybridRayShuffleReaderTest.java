package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.ray.api.exception.RayActorException;
import io.ray.api.exception.RayTaskException;
import io.ray.api.exception.RayTimeoutException;
import java.io.IOException;
import org.junit.jupiter.api.Test;

class HybridRayShuffleReaderTest {
  @Test
  void aMasterThatDidNotAnswerBlamesNoExecutor() {
    // A locate call that timed out or found the master dead fails the reduce task; only
    // the master's own answer (an unknown shuffle, say) becomes a FetchFailedException,
    // which makes Spark drop the blamed executor's map outputs.
    assertTrue(HybridRayShuffleReader.isControlPlaneFault(
        new IOException("hybrid_ray call spark_locate failed", new RayTimeoutException("2 min"))));
    assertTrue(HybridRayShuffleReader.isControlPlaneFault(
        new IOException("hybrid_ray call spark_locate failed", new RayActorException())));
    assertFalse(HybridRayShuffleReader.isControlPlaneFault(new IOException(
        "hybrid_ray call spark_locate failed", new RayTaskException("ShuffleNotFoundError"))));
    assertFalse(HybridRayShuffleReader.isControlPlaneFault(new IOException("bad JSON")));
  }
}
