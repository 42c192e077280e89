package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.ray.api.exception.RayActorException;
import io.ray.api.exception.RayTaskException;
import io.ray.api.exception.RayTimeoutException;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.ObjectOutputStream;
import java.util.Base64;
import java.util.HashMap;
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

  @Test
  void aMemoryLocationThatIsNoObjectRefIsRefusedBeforeAnythingElseIsBuilt() throws Exception {
    // Locations come from the master's books; Java deserialization of any other class
    // (here a HashMap: a gadget chain would start the same way) must be refused.
    ByteArrayOutputStream bytes = new ByteArrayOutputStream();
    try (ObjectOutputStream out = new ObjectOutputStream(bytes)) {
      out.writeObject(new HashMap<String, String>());
    }
    String location = Base64.getEncoder().encodeToString(bytes.toByteArray());
    IOException refused = assertThrows(IOException.class,
        () -> HybridRayShuffleReader.decodeRef(location));
    assertTrue(refused.getMessage().contains("REJECTED"), refused.getMessage());
    assertThrows(IOException.class, () -> HybridRayShuffleReader.decodeRef("not base64!"));
  }
}
